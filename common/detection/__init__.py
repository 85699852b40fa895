"""What the three detectors share, apart from their methods: detection sources in one schema (:mod:`.sources`),
the dataset, collate and ``--predict``'s batches (:mod:`.data`), box helpers (:mod:`.boxes`), COCO evaluation
(:mod:`.coco_eval`), pictures of detections (:mod:`.figures`) and what an evaluation or ``--predict`` writes
(:mod:`.outputs`)."""
