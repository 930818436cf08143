;; world: inferlet
  ;; Hostile: sends argument 0 to its client as a message, forever (until it is terminated).
  (func (export "run") (result i32)
    (local $text i32) (local $text_len i32)
    (call $runtime.arguments (global.get $RET))
    (local.set $text (i32.load (i32.load (global.get $RET))))
    (local.set $text_len (i32.load offset=4 (i32.load (global.get $RET))))
    (loop $more
      (call $messaging.send (local.get $text) (local.get $text_len))
      (br $more))
    unreachable)
