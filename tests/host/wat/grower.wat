;; world: inferlet
  ;; Grows as it goes (for suspension tests): like generate.wat, but decodes 12 tokens (or as
  ;; many as argument 1 has characters) and
  ;; allocates each page only when the sequence needs it (kv.allocate-pages 1, then appended),
  ;; so it meets a dry pool in the middle of its generation; its pages go back at its end.
  ;; Encodes argument 0 (default "hello"), prefills it, decodes greedily one pass at a time on
  ;; its own queue over a host-kept sequence, and returns the decoded text.
  (data (i32.const 1024) "hello")
  ;; forward.sampler, 48 bytes: kind u8 @0, temperature f32 @4, top-k @8, top-p f32 @12,
  ;; min-p f32 @16, seed option<u64> (tag @24, value @32), num-top @40. Greedy, temperature 1.0.
  (data (i32.const 2052) "\00\00\80\3f")
  (data (i32.const 2060) "\00\00\80\3f")
  (global $GREEDY i32 (i32.const 2048))
  (global $NUM_DECODE (mut i32) (i32.const 12))

  (global $page_size (mut i32) (i32.const 0))
  (global $num_seq_pages (mut i32) (i32.const 0)) ;; pages appended to the sequence so far
  (global $ctx (mut i32) (i32.const 0))          ;; tokens in the sequence
  (global $queue (mut i32) (i32.const 0))
  (global $seq (mut i32) (i32.const 0))
  (global $err_ptr (mut i32) (i32.const 0))
  (global $err_len (mut i32) (i32.const 0))

  ;; Append pages until the sequence holds $ctx + num_new tokens; returns last-page-len.
  (func $grow_sequence (param $num_new i32) (result i32)
    (local $total i32)
    (local.set $total (i32.add (global.get $ctx) (local.get $num_new)))
    (block $done
      (loop $more
        (br_if $done (i32.ge_u (i32.mul (global.get $num_seq_pages) (global.get $page_size))
                               (local.get $total)))
        (call $kv.allocate-pages (i32.const 1) (global.get $RET))
        (call $kv.sequence-append (global.get $seq) (i32.load (global.get $RET)) (i32.const 1))
        (global.set $num_seq_pages (i32.add (global.get $num_seq_pages) (i32.const 1)))
        (br $more)))
    (i32.sub (local.get $total)
             (i32.mul (i32.sub (global.get $num_seq_pages) (i32.const 1)) (global.get $page_size))))

  ;; One pass over `n` new tokens; returns the greedy token after the last one, or -1 on err.
  (func $forward (param $tokens i32) (param $n i32) (result i32)
    (local $positions i32) (local $i i32) (local $last_page_len i32) (local $future i32)
    (local.set $positions (call $alloc (i32.shl (local.get $n) (i32.const 2))))
    (block $done
      (loop $fill
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (i32.store (i32.add (local.get $positions) (i32.shl (local.get $i) (i32.const 2)))
                   (i32.add (global.get $ctx) (local.get $i)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $fill)))
    (local.set $last_page_len (call $grow_sequence (local.get $n)))
    (local.set $future
      (call $forward.submit (global.get $queue) (global.get $seq)
            (local.get $tokens) (local.get $n) (local.get $positions) (local.get $n)
            (local.get $last_page_len)
            (call $one (i32.sub (local.get $n) (i32.const 1))) (i32.const 1)
            (global.get $GREEDY) (i32.const 1)
            (i32.const 0) (i32.const 0) (i32.const 0)))
    (global.set $ctx (i32.add (global.get $ctx) (local.get $n)))
    (call $future.get (local.get $future) (global.get $RET))
    (call $future.drop (local.get $future))
    (if (i32.load8_u (global.get $RET))
      (then
        (global.set $err_ptr (i32.load offset=4 (global.get $RET)))
        (global.set $err_len (i32.load offset=8 (global.get $RET)))
        (return (i32.const -1))))
    ;; ok: list<output> (ptr @4); output 0 = (tag u8 @0: 0 = token, token u32 @4)
    (if (i32.load8_u (i32.load offset=4 (global.get $RET))) (then unreachable))
    (i32.load offset=4 (i32.load offset=4 (global.get $RET))))

  (func (export "run") (result i32)
    (local $prompt i32) (local $prompt_len i32) (local $tokens i32) (local $num_tokens i32)
    (local $out i32) (local $step i32) (local $token i32)
    (call $runtime.arguments (global.get $RET))
    (if (i32.load offset=4 (global.get $RET))
      (then (local.set $prompt (i32.load (i32.load (global.get $RET))))
            (local.set $prompt_len (i32.load offset=4 (i32.load (global.get $RET)))))
      (else (local.set $prompt (i32.const 1024)) (local.set $prompt_len (i32.const 5))))
    (if (i32.ge_u (i32.load offset=4 (global.get $RET)) (i32.const 2))
      (then (global.set $NUM_DECODE (i32.load offset=12 (i32.load (global.get $RET))))))
    (call $runtime.get-model-info (global.get $RET))
    (global.set $page_size (i32.load offset=8 (global.get $RET)))
    (call $tokenize.encode (local.get $prompt) (local.get $prompt_len) (global.get $RET))
    (local.set $tokens (i32.load (global.get $RET)))
    (local.set $num_tokens (i32.load offset=4 (global.get $RET)))
    (global.set $queue (call $queue.create (i32.const 1)))
    (global.set $seq (call $kv.create-sequence))
    (local.set $out (call $alloc (i32.shl (global.get $NUM_DECODE) (i32.const 2))))
    (local.set $token (call $forward (local.get $tokens) (local.get $num_tokens)))
    (block $done
      (loop $decode
        (if (i32.eq (local.get $token) (i32.const -1))
          (then (return (call $err (global.get $err_ptr) (global.get $err_len)))))
        (i32.store (i32.add (local.get $out) (i32.shl (local.get $step) (i32.const 2)))
                   (local.get $token))
        (local.set $step (i32.add (local.get $step) (i32.const 1)))
        (br_if $done (i32.ge_u (local.get $step) (global.get $NUM_DECODE)))
        (local.set $token (call $forward (call $one (local.get $token)) (i32.const 1)))
        (br $decode)))
    (call $kv.destroy-sequence (global.get $seq))
    (call $queue.destroy (global.get $queue))
    (call $tokenize.decode (local.get $out) (global.get $NUM_DECODE) (global.get $RET))
    (call $ok (i32.load (global.get $RET)) (i32.load offset=4 (global.get $RET))))
