"""A swarm of role agents: one instance per role, passing work around a ring over broadcast /
subscribe (no client in between).

    pie submit inferlets/examples/swarm.py -- --roles planner,writer,critic --role planner &
    pie submit inferlets/examples/swarm.py -- --roles planner,writer,critic --role writer &
    pie submit inferlets/examples/swarm.py -- --roles planner,writer,critic --role critic

Each agent subscribes to `swarm/<team>/<role>`, marks itself ready in the tenant's store and
waits (up to --ready-timeout-s) until every role of --roles is ready (give each run a fresh
--team: the ready keys stay). The first role starts from
--task; every agent then, --rounds times, turns the message it received into a user turn,
answers it (one greedy assistant turn in its own context, kept across rounds) and broadcasts
"<role>: <answer>" to the next role of the ring. A single role (the default) talks to itself.
Returns JSON: {role, received, sent, num_generated}.
"""
import time

import inferlet


def wait_until_ready(team: str, roles: list[str], timeout_s: float) -> None:
    """Block until every role has subscribed (each sets its ready key after subscribing)."""
    deadline = time.monotonic() + timeout_s
    while not all(inferlet.store_get(f"swarm/{team}/ready/{r}") for r in roles):
        if time.monotonic() > deadline:
            raise inferlet.InferletError(f"swarm {team!r}: not every role of {roles} "
                                         f"was ready within {timeout_s:g} s")
        time.sleep(0.005)


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="swarm", description="One role agent of a swarm.")
    parser.add_argument("--roles", default="writer", help="the ring of roles, comma-separated")
    parser.add_argument("--role", default="writer")
    parser.add_argument("--team", default="team")
    parser.add_argument("--task", default="Write a slogan for a bakery.")
    parser.add_argument("--rounds", type=int, default=2, help="messages each role sends")
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--ready-timeout-s", type=float, default=30.0)
    opts = parser.parse_args(args)
    roles = [r.strip() for r in opts.roles.split(",") if r.strip()]
    if opts.role not in roles or opts.rounds < 1:
        raise inferlet.InferletError(f"--role must be one of {roles} and --rounds >= 1")
    next_role = roles[(roles.index(opts.role) + 1) % len(roles)]

    inbox = inferlet.subscribe(f"swarm/{opts.team}/{opts.role}")
    inferlet.store_set(f"swarm/{opts.team}/ready/{opts.role}", "1")
    wait_until_ready(opts.team, roles, opts.ready_timeout_s)
    ctx = inferlet.Context()
    ctx.fill_system(f"You are the {opts.role} of a team of {', '.join(roles)}. Answer in one "
                    f"short sentence.")
    received, sent, num_generated = [], [], 0
    for round_index in range(opts.rounds):
        if round_index == 0 and opts.role == roles[0]:
            message = f"task: {opts.task}"
        else:
            message = inbox.receive()
            received.append(message)
        ctx.fill_user(message)
        generation = ctx.generation(opts.turn_tokens).run()
        num_generated += len(generation.token_ids)
        sent.append(f"{opts.role}: {generation.text.strip()}")
        inferlet.broadcast(f"swarm/{opts.team}/{next_role}", sent[-1])
    ctx.close()   # the ready key stays: a role may still be checking it (use a fresh --team)
    return {"role": opts.role, "received": received, "sent": sent, "num_generated": num_generated}
