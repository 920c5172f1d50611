"""The plain state types the whole hub shares: a job's round (job.py: JobState, ShardState,
AssignmentState, UpdateState...) and a node (node.py: NodeState). Below the scheduler, the store
and the rounds; imports base and policy only."""
