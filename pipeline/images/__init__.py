"""How an image becomes the model's input, the same in every place that reads one: preprocess.py (decode, the
served framing, resize; prepare, the server, `pipeline predict`) and served_input.py (the test split's original files
through the server's own decode, for the served accuracy of optimize and evaluate)."""
