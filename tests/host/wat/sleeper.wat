;; world: inferlet-sleep
  ;; Hostile: holds 2 pages, sends "sleeping", then blocks 10 s in a WASI sleep (what a Python
  ;; guest's time.sleep(10) does), where Wasmtime's epoch deadline cannot reach it. Terminate must
  ;; still end it (and return its pages) within 1 s. Returns "woke" if it ever wakes.
  (import "wasi:clocks/monotonic-clock@0.2.0" "subscribe-duration" (func $subscribe (param i64) (result i32)))
  (import "wasi:io/poll@0.2.0" "[method]pollable.block" (func $block (param i32)))
  (data (i32.const 1024) "sleeping")
  (data (i32.const 1040) "woke")
  (func (export "run") (result i32)
    (call $kv.allocate-pages (i32.const 2) (global.get $RET))
    (call $messaging.send (i32.const 1024) (i32.const 8))
    (call $block (call $subscribe (i64.const 10000000000)))
    (call $ok (i32.const 1040) (i32.const 4)))
