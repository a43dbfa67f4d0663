"""Training: the run configuration (`RunConfig` and its sections), the loop (`trainer.train`), optimizers,
checkpoints and metrics.

    from megadlms.training import RunConfig, TrainConfig
    from megadlms.training.trainer import train
    state = train(RunConfig(train=TrainConfig(train_iters=100, device="cpu")))
"""

from .config import CheckpointConfig, DiffusionConfig, FP8Config, LoraSettings, ModelConfig, RunConfig, TrainConfig

__all__ = ["CheckpointConfig", "DiffusionConfig", "FP8Config", "LoraSettings", "ModelConfig", "RunConfig",
           "TrainConfig"]
