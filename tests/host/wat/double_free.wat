;; world: inferlet
  ;; Hostile: frees the same page twice.
  (func (export "run") (result i32)
    (local $pages i32)
    (call $kv.allocate-pages (i32.const 1) (global.get $RET))
    (local.set $pages (i32.load (global.get $RET)))
    (call $kv.free-pages (local.get $pages) (i32.const 1))
    (call $kv.free-pages (local.get $pages) (i32.const 1))
    unreachable)
