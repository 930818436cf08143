;; world: inferlet
  ;; Logs 1,000 lines of 8,192 characters (8 M characters) through runtime.log, then returns
  ;; "said it all".
  (data (i32.const 1024) "said it all")
  (func (export "run") (result i32)
    (local $line i32) (local $i i32)
    (local.set $line (call $alloc (i32.const 8192)))
    (memory.fill (local.get $line) (i32.const 120) (i32.const 8192))
    (loop $more
      (call $runtime.log (local.get $line) (i32.const 8192))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $more (i32.lt_u (local.get $i) (i32.const 1000))))
    (call $ok (i32.const 1024) (i32.const 11)))
