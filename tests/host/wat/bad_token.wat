;; world: inferlet
  ;; Hostile: submits a pass whose one token id (2147483647) is outside the vocabulary. The host
  ;; must trap it at forward.submit (host/kv/instance_pages.py, with the runtime's vocab size),
  ;; before the pass reaches a batch shared with other instances.
  ;; forward.sampler at 2048 as in generate.wat: greedy, temperature 1.0.
  (data (i32.const 2052) "\00\00\80\3f")
  (data (i32.const 2060) "\00\00\80\3f")
  (func (export "run") (result i32)
    (local $queue i32) (local $seq i32) (local $pages i32)
    (call $kv.allocate-pages (i32.const 1) (global.get $RET))
    (local.set $pages (i32.load (global.get $RET)))
    (local.set $queue (call $queue.create (i32.const 1)))
    (local.set $seq (call $kv.create-sequence))
    (call $kv.sequence-append (local.get $seq) (local.get $pages) (i32.const 1))
    (drop (call $forward.submit (local.get $queue) (local.get $seq)
          (call $one (i32.const 2147483647)) (i32.const 1)    ;; token-ids
          (call $one (i32.const 0)) (i32.const 1)             ;; positions
          (i32.const 1)                                       ;; last-page-len
          (call $one (i32.const 0)) (i32.const 1)             ;; output-indices
          (i32.const 2048) (i32.const 1)                      ;; samplers
          (i32.const 0) (i32.const 0) (i32.const 0)))         ;; mask: none
    unreachable)
