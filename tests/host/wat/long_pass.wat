;; world: inferlet
  ;; Hostile: one page listed 2,048 times in a sequence, then a pass of one token over it (8,192
  ;; KV slots with pages of 4, twice the fake model's context). The host must trap it at
  ;; forward.submit naming the context length, before the pass reaches a shared batch.
  ;; forward.sampler at 2048 as in generate.wat: greedy, temperature 1.0.
  (data (i32.const 2052) "\00\00\80\3f")
  (data (i32.const 2060) "\00\00\80\3f")
  (func (export "run") (result i32)
    (local $queue i32) (local $seq i32) (local $page i32) (local $list i32) (local $i i32)
    (call $kv.allocate-pages (i32.const 1) (global.get $RET))
    (local.set $page (i32.load (i32.load (global.get $RET))))
    (local.set $list (call $alloc (i32.const 8192)))
    (loop $fill
      (i32.store (i32.add (local.get $list) (i32.shl (local.get $i) (i32.const 2))) (local.get $page))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $fill (i32.lt_u (local.get $i) (i32.const 2048))))
    (local.set $queue (call $queue.create (i32.const 1)))
    (local.set $seq (call $kv.create-sequence))
    (call $kv.sequence-append (local.get $seq) (local.get $list) (i32.const 2048))
    (drop (call $forward.submit (local.get $queue) (local.get $seq)
          (call $one (i32.const 1)) (i32.const 1)             ;; token-ids
          (call $one (i32.const 0)) (i32.const 1)             ;; positions
          (i32.const 1)                                       ;; last-page-len
          (call $one (i32.const 0)) (i32.const 1)             ;; output-indices
          (i32.const 2048) (i32.const 1)                      ;; samplers
          (i32.const 0) (i32.const 0) (i32.const 0)))         ;; mask: none
    unreachable)
