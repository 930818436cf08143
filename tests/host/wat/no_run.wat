;; world: no-run
(module
  (import "pie:inferlet/runtime@0.1.0" "log" (func $log (param i32 i32)))
  (memory (export "memory") 1)
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) (i32.const 4096))
  (func (export "start") (result i32) unreachable))
