;; world: inferlet
  ;; Benchmark guest. Argument 0: "noop" (messaging.try-receive, which returns none) or "step"
  ;; (a decode step: forward.submit of 1 token + get + drop); argument 1: the count, in decimal.
  ;; Returns "done".
  (data (i32.const 1024) "done")
  (data (i32.const 2052) "\00\00\80\3f")
  (data (i32.const 2060) "\00\00\80\3f")

  (func $parse_u32 (param $ptr i32) (param $len i32) (result i32)
    (local $value i32) (local $i i32)
    (block $done
      (loop $digit
        (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
        (local.set $value (i32.add (i32.mul (local.get $value) (i32.const 10))
                                   (i32.sub (i32.load8_u (i32.add (local.get $ptr) (local.get $i)))
                                            (i32.const 48))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $digit)))
    (local.get $value))

  (func $noop_loop (param $count i32)
    (local $i i32)
    (block $done
      (loop $call
        (br_if $done (i32.ge_u (local.get $i) (local.get $count)))
        (call $messaging.try-receive (global.get $RET))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $call))))

  (func $step_loop (param $count i32)
    (local $i i32) (local $seq i32) (local $queue i32) (local $token i32) (local $zero i32)
    (local $future i32)
    (call $kv.allocate-pages (i32.const 1) (global.get $RET))
    (local.set $seq (call $kv.create-sequence))
    (call $kv.sequence-append (local.get $seq) (i32.load (global.get $RET)) (i32.const 1))
    (local.set $queue (call $queue.create (i32.const 1)))
    (local.set $token (call $one (i32.const 97)))
    (local.set $zero (call $one (i32.const 0)))
    (block $done
      (loop $step
        (br_if $done (i32.ge_u (local.get $i) (local.get $count)))
        (local.set $future
          (call $forward.submit (local.get $queue) (local.get $seq)
                (local.get $token) (i32.const 1) (local.get $zero) (i32.const 1) (i32.const 1)
                (local.get $zero) (i32.const 1) (i32.const 2048) (i32.const 1)
                (i32.const 0) (i32.const 0) (i32.const 0)))
        (call $future.get (local.get $future) (global.get $RET))
        (call $future.drop (local.get $future))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $step))))

  (func (export "run") (result i32)
    (local $args i32) (local $count i32)
    (call $runtime.arguments (global.get $RET))
    (local.set $args (i32.load (global.get $RET)))
    (local.set $count (call $parse_u32 (i32.load offset=8 (local.get $args))
                                       (i32.load offset=12 (local.get $args))))
    (if (i32.eq (i32.load8_u (i32.load (local.get $args))) (i32.const 110))   ;; 'n'oop
      (then (call $noop_loop (local.get $count)))
      (else (call $step_loop (local.get $count))))
    (call $ok (i32.const 1024) (i32.const 4)))
