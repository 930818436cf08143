;; world: inferlet
  ;; Never reads its client messages: holds 1 page, sends "listening", then waits on a topic
  ;; nobody broadcasts to, until terminated.
  (data (i32.const 1024) "listening")
  (data (i32.const 1040) "silence")
  (func (export "run") (result i32)
    (call $kv.allocate-pages (i32.const 1) (global.get $RET))
    (call $messaging.send (i32.const 1024) (i32.const 9))
    (call $messaging.subscribe (i32.const 1040) (i32.const 7))
    (call $messaging.receive-topic (i32.const 1040) (i32.const 7) (global.get $RET))
    unreachable)
