"""The fleet: rollbus engines placed by Ray and driven by RL frameworks (docs/fleet.md).

`engine.fleet.serve_args` (pure) turns vLLM's serve Namespace into a `rollbus serve` command line;
`engine.fleet.skyrl_actor` is the Ray actor SkyRL's ServerGroup places (standard library and Ray only);
`engine.fleet.skyrl_compat` works around SkyRL 0.4's bugs; `engine.fleet.rejoin` (the coordinator's) starts a
restarted engine on the weight version its recovery copies hold, or (`engine.fleet.catch_up`) on the fleet's
version fetched from a peer's copies (their file format: `engine.fleet.copy_format`, pure);
`engine.fleet.ray_executor` runs an engine's
workers as Ray actors (`--distributed-executor-backend ray`) on the placement `engine.fleet.ray_placement`
(pure) plans. Only skyrl_actor and ray_executor import Ray (`pip install rollbus[ray]`). Importing this
package imports neither Ray nor SkyRL.
"""
