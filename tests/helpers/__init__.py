"""What the tests share, by what each part builds: runs.py (the tiny config, training runs, the shared runs' test
split), bundles.py (tiny random bundles, their oracles, a Hub cache), onnx.py (ONNX folders, int8 checks),
images.py (image files and folders), datasets.py (COCO and Karpathy files), coca.py (the colour models),
processes.py (processes, stopped and resumed trainings); and the scripts the tests start."""
