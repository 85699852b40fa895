"""What a trained model leaves the project as: ONNX (and ``.pt2``) exports checked against eager
(:mod:`.export`, :mod:`.export_check`), the model folder timm and the hub load (:mod:`.model_folder`), and the
pictures and tables of an evaluation (:mod:`.figures`). The loop core imports none of them."""
