  ;; Prelude (library) of every test guest: memory, a bump allocator, the result of `run`.
  ;; Memory map: [16, 28) the return area of `run`; [64, 192) $RET, where host calls write their
  ;; results; [1024, 8192) the guest's static data; [8192, ...) the heap.
  (memory (export "memory") 1)
  (global $RUN_RET i32 (i32.const 16))
  (global $RET i32 (i32.const 64))
  (global $heap (mut i32) (i32.const 8192))

  ;; Allocate `size` bytes, 8-aligned, growing memory as needed (traps when it cannot grow).
  (func $alloc (param $size i32) (result i32)
    (local $ptr i32) (local $end i32) (local $have i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (local.set $end (i32.add (local.get $ptr) (local.get $size)))
    (local.set $have (i32.shl (memory.size) (i32.const 16)))
    (if (i32.gt_u (local.get $end) (local.get $have))
      (then
        (if (i32.eq (memory.grow (i32.shr_u (i32.add (i32.sub (local.get $end) (local.get $have))
                                                     (i32.const 65535))
                                            (i32.const 16)))
                    (i32.const -1))
          (then unreachable))))
    (global.set $heap (local.get $end))
    (local.get $ptr))

  (func (export "cabi_realloc") (param $old i32) (param $old_size i32) (param $align i32)
                                (param $new_size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (call $alloc (local.get $new_size)))
    (if (local.get $old)
      (then (memory.copy (local.get $ptr) (local.get $old)
                         (select (local.get $old_size) (local.get $new_size)
                                 (i32.lt_u (local.get $old_size) (local.get $new_size))))))
    (local.get $ptr))

  (func (export "cabi_post_run") (param i32))

  ;; `run` returns result<string, string>: a pointer to (tag, ptr, len).
  (func $ok (param $ptr i32) (param $len i32) (result i32)
    (i32.store8 (global.get $RUN_RET) (i32.const 0))
    (i32.store offset=4 (global.get $RUN_RET) (local.get $ptr))
    (i32.store offset=8 (global.get $RUN_RET) (local.get $len))
    (global.get $RUN_RET))
  (func $err (param $ptr i32) (param $len i32) (result i32)
    (i32.store8 (global.get $RUN_RET) (i32.const 1))
    (i32.store offset=4 (global.get $RUN_RET) (local.get $ptr))
    (i32.store offset=8 (global.get $RUN_RET) (local.get $len))
    (global.get $RUN_RET))

  ;; A list<u32> of one element.
  (func $one (param $value i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (call $alloc (i32.const 4)))
    (i32.store (local.get $ptr) (local.get $value))
    (local.get $ptr))

  ;; The decimal digits of $value at 1024 (the guest's static data) (at most 10); returns their count.
  (func $decimal (param $value i32) (result i32)
    (local $len i32) (local $i i32) (local $tmp i32)
    (loop $digit
      (i32.store8 (i32.add (i32.const 1024) (local.get $len))
                  (i32.add (i32.const 48) (i32.rem_u (local.get $value) (i32.const 10))))
      (local.set $len (i32.add (local.get $len) (i32.const 1)))
      (local.set $value (i32.div_u (local.get $value) (i32.const 10)))
      (br_if $digit (local.get $value)))
    (local.set $i (i32.const 0))
    (block $done (loop $swap
      (br_if $done (i32.ge_u (local.get $i) (i32.sub (i32.sub (local.get $len) (local.get $i)) (i32.const 1))))
      (local.set $tmp (i32.load8_u (i32.add (i32.const 1024) (local.get $i))))
      (i32.store8 (i32.add (i32.const 1024) (local.get $i))
                  (i32.load8_u (i32.sub (i32.add (i32.const 1023) (local.get $len)) (local.get $i))))
      (i32.store8 (i32.sub (i32.add (i32.const 1023) (local.get $len)) (local.get $i)) (local.get $tmp))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $swap)))
    (local.get $len))
