"""Weight sync from the learner to inference engines (SGLang's protocol), trainer and engine side."""
