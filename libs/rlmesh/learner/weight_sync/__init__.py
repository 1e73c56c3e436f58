"""Weight sync, the learner's side: full weights gathered bucket by bucket and pushed to every engine
over torch.distributed with SGLang's update protocol."""
