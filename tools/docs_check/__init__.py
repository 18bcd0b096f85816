"""The parts of ``tools/docs_check.py`` (``make docs-check``): ``extract`` finds the commands of
the markdown files, ``rules`` classifies them and says how each class is checked, ``sandbox``
copies the tree and runs commands in it, ``identity`` says whether a launch would continue a
run the sandbox already holds. ``extract`` and ``rules`` are pure (no process, no file write).
"""
