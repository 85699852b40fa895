"""Data helpers a recipe calls while building its datasets, and a reader of the loop can skip: classification
and unlabelled sources (:mod:`.classification`), image decoding and the files ``--predict`` names
(:mod:`.images`), the scan for unreadable images before the first step (:mod:`.scan`), ``--cache_images``
(:mod:`.image_cache`) and the built-in sets (:mod:`.builtin`, a leaf: it imports nothing else of ``common``).

Each helper takes the settings it uses as arguments (never the run or its config) and returns what it adds:
the data, the lines for under the start banner and the files for the run folder, which the recipe hands
to its run (:meth:`common.run.Run.note`, ``run.files``); a dataset gets its image cache when it is built."""
