;; world: inferlet
  ;; Hostile: fills the tenant's key-value store: 256 Ki-character values under keys "0", "1",
  ;; ... until the store refuses (a trap naming its character limit).
  (func (export "run") (result i32)
    (local $value i32) (local $i i32)
    (local.set $value (call $alloc (i32.const 262144)))
    (memory.fill (local.get $value) (i32.const 97) (i32.const 262144))
    (loop $more
      (call $messaging.store-set (i32.const 1024) (call $decimal (local.get $i))
                                 (local.get $value) (i32.const 262144))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $more))
    unreachable)
