;; world: inferlet
  ;; Hostile: allocates 4 pages at a time, forever (until its quota stops it).
  (func (export "run") (result i32)
    (loop $more
      (call $kv.allocate-pages (i32.const 4) (global.get $RET))
      (br $more))
    unreachable)
