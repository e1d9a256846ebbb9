import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from vitattn.evaluation.classification import topk_hits


@pytest.mark.parametrize("classes", [3, 10])
def test_topk_hits_divided_by_the_images_are_torchmetrics_top1_and_top5(classes):
    torch.manual_seed(0)
    logits, targets = torch.randn(17, classes), torch.randint(classes, (17,))  # (B, K), (B,)
    top1, top5, images = topk_hits(logits, targets).tolist()
    assert images == 17
    expected1 = MulticlassAccuracy(classes, top_k=1, average="micro")(logits, targets)
    expected5 = MulticlassAccuracy(classes, top_k=min(5, classes), average="micro")(logits, targets)
    torch.testing.assert_close(torch.tensor([top1 / images, top5 / images]), torch.stack([expected1, expected5]))
