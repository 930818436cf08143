;; world: inferlet
  ;; Hostile: grows memory 1 MiB at a time until the host refuses (memory.grow -> -1), then
  ;; returns an error that does not mention memory, as CPython does when a str concatenation no
  ;; longer fits ("TypeError: unsupported operand type(s) for +: '' and ''"). The outcome must
  ;; name the memory limit all the same.
  (data (i32.const 1024) "TypeError: unsupported operand type(s) for +: '' and ''")
  (func (export "run") (result i32)
    (block $refused
      (loop $grow
        (br_if $refused (i32.eq (memory.grow (i32.const 16)) (i32.const -1)))
        (br $grow)))
    (call $err (i32.const 1024) (i32.const 55)))
