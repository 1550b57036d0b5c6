"""What a run reports: TensorBoard, JSON files, the learning-rate sweep, the console."""
