"""The last mile: a model card for a converted model folder, and its upload to the Hub.

Files: card.py (``build_card``: DIR/README.md from the folder's conversion report, training summary and
evaluation report, validated with huggingface_hub's card classes), template.md (the card's text), push.py
(``push_folder``: checks the folder, then creates the repository and uploads it with huggingface_hub).
"""
