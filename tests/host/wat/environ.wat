;; world: inferlet-environ
  ;; Counts what WASI exposes: environment variables, WASI argv, preopened directories.
  ;; Returns "sandboxed" when all three are empty, else err "exposed".
  (import "wasi:cli/environment@0.2.0" "get-environment" (func $get-environment (param i32)))
  (import "wasi:cli/environment@0.2.0" "get-arguments" (func $get-arguments (param i32)))
  (import "wasi:filesystem/preopens@0.2.0" "get-directories" (func $get-directories (param i32)))
  (data (i32.const 1024) "sandboxed")
  (data (i32.const 1040) "exposed")
  (func (export "run") (result i32)
    (local $count i32)
    (call $get-environment (global.get $RET))
    (local.set $count (i32.load offset=4 (global.get $RET)))
    (call $get-arguments (global.get $RET))
    (local.set $count (i32.add (local.get $count) (i32.load offset=4 (global.get $RET))))
    (call $get-directories (global.get $RET))
    (local.set $count (i32.add (local.get $count) (i32.load offset=4 (global.get $RET))))
    (if (local.get $count) (then (return (call $err (i32.const 1040) (i32.const 7)))))
    (call $ok (i32.const 1024) (i32.const 9)))
