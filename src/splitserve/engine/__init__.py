"""The engine: requests, block pool, scheduler, model runner, sampler and the step loop."""
