;; world: inferlet
  ;; holder.wat that reports its suspended time: allocates len(argument 0) pages, sends
  ;; "holding"; each client message allocates len(message) more and sends "holding" again; an
  ;; empty message frees everything and returns runtime.suspended-ms in decimal.
  (import "pie:inferlet/runtime@0.1.0" "suspended-ms" (func $runtime.suspended-ms (result i64)))
  (data (i32.const 1040) "holding")
  (func $hold (param $num_pages i32)
    (call $kv.allocate-pages (local.get $num_pages) (global.get $RET))
    (call $messaging.send (i32.const 1040) (i32.const 7)))
  (func (export "run") (result i32)
    (call $runtime.arguments (global.get $RET))
    (call $hold (i32.load offset=4 (i32.load (global.get $RET))))
    (block $done
      (loop $next
        (call $messaging.receive (global.get $RET))
        (br_if $done (i32.eqz (i32.load offset=4 (global.get $RET))))
        (call $hold (i32.load offset=4 (global.get $RET)))
        (br $next)))
    (call $ok (i32.const 1024)
              (call $decimal (i32.wrap_i64 (call $runtime.suspended-ms)))))
