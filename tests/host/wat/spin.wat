;; world: inferlet
  ;; Hostile: computes forever without calling the host.
  (func (export "run") (result i32)
    (loop $forever (br $forever))
    unreachable)
