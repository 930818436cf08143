;; world: inferlet
  ;; Subscribes to topic "news", sends "subscribed", returns the first broadcast it receives.
  (data (i32.const 1024) "news")
  (data (i32.const 1040) "subscribed")
  (func (export "run") (result i32)
    (call $messaging.subscribe (i32.const 1024) (i32.const 4))
    (call $messaging.send (i32.const 1040) (i32.const 10))
    (call $messaging.receive-topic (i32.const 1024) (i32.const 4) (global.get $RET))
    (call $ok (i32.load (global.get $RET)) (i32.load offset=4 (global.get $RET))))
