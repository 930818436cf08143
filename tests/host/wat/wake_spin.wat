;; world: inferlet
  ;; Hostile after a wait: blocks in receive, then computes forever without calling the host.
  (func (export "run") (result i32)
    (call $messaging.receive (global.get $RET))
    (loop $forever (br $forever))
    unreachable)
