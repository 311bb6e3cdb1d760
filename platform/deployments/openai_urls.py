from django.urls import path

from deployments import openai

urlpatterns = [
    path("chat/completions", openai.chat_completions, name="openai-chat"),
    path("completions", openai.completions, name="openai-completions"),
    path("models", openai.models, name="openai-models"),
]
