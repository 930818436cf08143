;; world: inferlet
  ;; Returns ok with a string of 2 Mi characters ("a" repeated).
  (func (export "run") (result i32)
    (local $text i32)
    (local.set $text (call $alloc (i32.const 2097152)))
    (memory.fill (local.get $text) (i32.const 97) (i32.const 2097152))
    (call $ok (local.get $text) (i32.const 2097152)))
