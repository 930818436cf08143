;; world: inferlet
  ;; Hostile: submits a pass whose `sample` sampler has temperature NaN (the first bytes of an f32
  ;; quiet NaN). The host must trap it at forward.submit (host/bindings/forward.py), before the
  ;; pass reaches a batch shared with other instances (`nan < 0` is False: a plain range check
  ;; lets it through, and the sampler then fails the whole batch).
  ;; forward.sampler at 2048: kind sample (1), temperature NaN, top-p 1.0.
  (data (i32.const 2048) "\01")
  (data (i32.const 2052) "\00\00\c0\7f")
  (data (i32.const 2060) "\00\00\80\3f")
  (func (export "run") (result i32)
    (local $queue i32) (local $seq i32) (local $pages i32)
    (call $kv.allocate-pages (i32.const 1) (global.get $RET))
    (local.set $pages (i32.load (global.get $RET)))
    (local.set $queue (call $queue.create (i32.const 1)))
    (local.set $seq (call $kv.create-sequence))
    (call $kv.sequence-append (local.get $seq) (local.get $pages) (i32.const 1))
    (drop (call $forward.submit (local.get $queue) (local.get $seq)
          (call $one (i32.const 1)) (i32.const 1)             ;; token-ids
          (call $one (i32.const 0)) (i32.const 1)             ;; positions
          (i32.const 1)                                       ;; last-page-len
          (call $one (i32.const 0)) (i32.const 1)             ;; output-indices
          (i32.const 2048) (i32.const 1)                      ;; samplers
          (i32.const 0) (i32.const 0) (i32.const 0)))         ;; mask: none
    unreachable)
