;; world: inferlet
  ;; Sends back every client message until an empty one; then returns "bye".
  (data (i32.const 1024) "bye")
  (func (export "run") (result i32)
    (block $done
      (loop $next
        (call $messaging.receive (global.get $RET))
        (br_if $done (i32.eqz (i32.load offset=4 (global.get $RET))))
        (call $messaging.send (i32.load (global.get $RET)) (i32.load offset=4 (global.get $RET)))
        (br $next)))
    (call $ok (i32.const 1024) (i32.const 3)))
