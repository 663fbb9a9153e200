"""Images for vision-language models, the parts both processes agree on.

No torch and no anyio here: Pillow and numpy only, so the front end (and the offline
API) can turn a decoded image into what the engine takes (``protocol.ImageInput``).
``processor.py`` says what a family's image processor provides; one module per family
implements it (``gemma3.py``, ``idefics3.py``), equal to its transformers processor.
"""
