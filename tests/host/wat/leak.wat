;; world: inferlet
  ;; Exits without freeing: 3 pages in a sequence, a pass submitted and never awaited (its future
  ;; never dropped), a non-persistent export. Returns "leaked".
  (data (i32.const 1024) "leaked")
  (data (i32.const 1040) "leak-export")
  (data (i32.const 2052) "\00\00\80\3f")
  (data (i32.const 2060) "\00\00\80\3f")
  (func (export "run") (result i32)
    (local $pages i32) (local $seq i32) (local $queue i32) (local $tokens i32)
    (call $kv.allocate-pages (i32.const 3) (global.get $RET))
    (local.set $pages (i32.load (global.get $RET)))
    (local.set $seq (call $kv.create-sequence))
    (local.set $queue (call $queue.create (i32.const 1)))
    (call $kv.sequence-append (local.get $seq) (local.get $pages) (i32.const 1))
    (local.set $tokens (call $alloc (i32.const 8)))
    (i64.store (local.get $tokens) (i64.const 0x0000006200000061))   ;; tokens [97, 98]
    (i64.store (call $alloc (i32.const 8)) (i64.const 0x0000000100000000))
    (drop (call $forward.submit (local.get $queue) (local.get $seq)
                (local.get $tokens) (i32.const 2) (i32.add (local.get $tokens) (i32.const 8)) (i32.const 2)
                (i32.const 2) (call $one (i32.const 1)) (i32.const 1) (i32.const 2048) (i32.const 1)
                (i32.const 0) (i32.const 0) (i32.const 0)))
    (call $kv.export-pages (i32.const 1040) (i32.const 11)
          (i32.add (local.get $pages) (i32.const 4)) (i32.const 2) (i32.const 0) (global.get $RET))
    (call $ok (i32.const 1024) (i32.const 6)))
