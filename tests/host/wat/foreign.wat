;; world: foreign-import
(module
  (import "pie:test/gadget@0.1.0" "frob" (func $frob (param i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) (i32.const 4096))
  (func (export "run") (result i32) unreachable))
