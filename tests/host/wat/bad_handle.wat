;; world: inferlet
  ;; Hostile: calls forward-future.get on a handle it never received.
  (func (export "run") (result i32)
    (call $future.get (i32.const 77) (global.get $RET))
    unreachable)
