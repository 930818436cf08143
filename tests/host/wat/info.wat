;; world: inferlet
  ;; Logs the host version, prints nothing, returns its instance id.
  (func (export "run") (result i32)
    (call $runtime.version (global.get $RET))
    (call $runtime.log (i32.load (global.get $RET)) (i32.load offset=4 (global.get $RET)))
    (call $runtime.instance-id (global.get $RET))
    (call $ok (i32.load (global.get $RET)) (i32.load offset=4 (global.get $RET))))
