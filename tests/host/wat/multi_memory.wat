;; world: inferlet
  ;; Hostile: three memories besides the main one, each grown 64 KiB at a time until the store
  ;; refuses, main memory last. Returns the number of 64 KiB pages it got in all four, in decimal
  ;; (the instance's total must stay within its memory limit, not the limit times four).
  (memory $m1 0)
  (memory $m2 0)
  (memory $m3 0)
  (func $grow_m1 (result i32) (local $n i32)
    (block $full (loop $more
      (br_if $full (i32.eq (memory.grow $m1 (i32.const 1)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 1))) (br $more)))
    (local.get $n))
  (func $grow_m2 (result i32) (local $n i32)
    (block $full (loop $more
      (br_if $full (i32.eq (memory.grow $m2 (i32.const 1)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 1))) (br $more)))
    (local.get $n))
  (func $grow_m3 (result i32) (local $n i32)
    (block $full (loop $more
      (br_if $full (i32.eq (memory.grow $m3 (i32.const 1)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 1))) (br $more)))
    (local.get $n))
  (func $grow_main (result i32) (local $n i32)
    (local.set $n (memory.size))
    (block $full (loop $more
      (br_if $full (i32.eq (memory.grow (i32.const 1)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 1))) (br $more)))
    (local.get $n))
  (func (export "run") (result i32)
    (local $total i32)
    (local.set $total (i32.add (i32.add (call $grow_m1) (call $grow_m2))
                               (i32.add (call $grow_m3) (call $grow_main))))
    (call $ok (i32.const 1024) (call $decimal (local.get $total))))
