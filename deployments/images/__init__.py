"""Image models (model_type image-generation, image-edit): their service and the images in and out."""
