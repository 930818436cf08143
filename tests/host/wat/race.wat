;; world: inferlet
(module
  ;; The wasmtime-py race: 20 rounds of kv.import-pages (the host answers ok(list) or err(str):
  ;; both cases of an untagged result get lowered) and messaging.try-receive (option<string>),
  ;; then kv.list-exports, which the race host makes raise a Python exception.
  (import "pie:inferlet/kv@0.1.0" "import-pages" (func $import-pages (param i32 i32 i32)))
  (import "pie:inferlet/kv@0.1.0" "list-exports" (func $list-exports (param i32)))
  (import "pie:inferlet/messaging@0.1.0" "try-receive" (func $try-receive (param i32)))
  (memory (export "memory") 1)
  (global $heap (mut i32) (i32.const 8192))
  (data (i32.const 1024) "x")
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (global.set $heap (i32.add (local.get $ptr) (local.get 3)))
    (if (i32.gt_u (global.get $heap) (i32.const 65536)) (then (global.set $heap (i32.const 8192))
        (local.set $ptr (i32.const 8192)) (global.set $heap (i32.add (i32.const 8192) (local.get 3)))))
    (local.get $ptr))
  (func (export "run") (result i32)
    (local $i i32)
    (block $done
      (loop $round
        (br_if $done (i32.ge_u (local.get $i) (i32.const 20)))
        (call $import-pages (i32.const 1024) (i32.const 1) (i32.const 64))
        (call $try-receive (i32.const 64))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $round)))
    (call $list-exports (i32.const 64))
    unreachable))
