;; world: inferlet-stdio
  ;; Writes a line to stdout and one to stderr (which must reach the instance log, not the
  ;; terminal), then returns "printed".
  (import "wasi:cli/stdout@0.2.0" "get-stdout" (func $get-stdout (result i32)))
  (import "wasi:cli/stderr@0.2.0" "get-stderr" (func $get-stderr (result i32)))
  (import "wasi:io/streams@0.2.0" "[method]output-stream.blocking-write-and-flush" (func $write (param i32 i32 i32 i32)))
  (data (i32.const 1024) "hello from stdout\n")
  (data (i32.const 1088) "warning on stderr\n")
  (data (i32.const 1152) "printed")
  (func (export "run") (result i32)
    (call $write (call $get-stdout) (i32.const 1024) (i32.const 18) (global.get $RET))
    (call $write (call $get-stderr) (i32.const 1088) (i32.const 18) (global.get $RET))
    (call $ok (i32.const 1152) (i32.const 7)))
