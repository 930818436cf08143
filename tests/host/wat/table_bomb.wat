;; world: inferlet
  ;; Hostile: three tables of its own, each grown 4,096 elements at a time until the store refuses.
  ;; Returns the number of elements it got in all three, in decimal.
  (table $t1 0 funcref)
  (table $t2 0 funcref)
  (table $t3 0 funcref)
  (func $grow_t1 (result i32) (local $n i32)
    (block $full (loop $more
      (br_if $full (i32.eq (table.grow $t1 (ref.null func) (i32.const 4096)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 4096))) (br $more)))
    (local.get $n))
  (func $grow_t2 (result i32) (local $n i32)
    (block $full (loop $more
      (br_if $full (i32.eq (table.grow $t2 (ref.null func) (i32.const 4096)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 4096))) (br $more)))
    (local.get $n))
  (func $grow_t3 (result i32) (local $n i32)
    (block $full (loop $more
      (br_if $full (i32.eq (table.grow $t3 (ref.null func) (i32.const 4096)) (i32.const -1)))
      (local.set $n (i32.add (local.get $n) (i32.const 4096))) (br $more)))
    (local.get $n))
  (func (export "run") (result i32)
    (call $ok (i32.const 1024) (call $decimal (i32.add (call $grow_t1)
                                                       (i32.add (call $grow_t2) (call $grow_t3))))))
