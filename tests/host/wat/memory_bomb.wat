;; world: inferlet-stdio
  ;; Hostile: grows memory 1 MiB at a time until the store limit refuses (memory.grow -> -1),
  ;; then does what CPython does: "MemoryError" on stderr, then abort (unreachable).
  (import "wasi:cli/stderr@0.2.0" "get-stderr" (func $get-stderr (result i32)))
  (import "wasi:io/streams@0.2.0" "[method]output-stream.blocking-write-and-flush" (func $write (param i32 i32 i32 i32)))
  (data (i32.const 1024) "MemoryError\n")
  (func (export "run") (result i32)
    (block $refused
      (loop $grow
        (br_if $refused (i32.eq (memory.grow (i32.const 16)) (i32.const -1)))
        (br $grow)))
    (call $write (call $get-stderr) (i32.const 1024) (i32.const 12) (global.get $RET))
    unreachable)
