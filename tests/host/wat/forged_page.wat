;; world: inferlet
  ;; Hostile: allocates 2 pages, then frees page id 12345, which it never owned.
  (func (export "run") (result i32)
    (call $kv.allocate-pages (i32.const 2) (global.get $RET))
    (call $kv.free-pages (call $one (i32.const 12345)) (i32.const 1))
    unreachable)
