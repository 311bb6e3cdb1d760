from django.contrib.auth import authenticate
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.authtoken.models import Token
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import Text


class LoginSerializer(serializers.Serializer):
    username = Text()
    password = Text(style={"input_type": "password"})


class TokenView(APIView):
    """Exchanges a username and password for the user's API token."""

    permission_classes = [AllowAny]
    authentication_classes: list = []
    # Scripts log in with `curl -d username=… -d password=…` (or -F) as readily as with JSON.
    parser_classes = [JSONParser, FormParser, MultiPartParser]

    @extend_schema(
        request=LoginSerializer,
        responses=inline_serializer("TokenResponse", {"token": serializers.CharField()}),
    )
    def post(self, request: Request) -> Response:
        body = LoginSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = authenticate(request, **body.validated_data)
        if user is None:
            return Response({"detail": "Unknown username or wrong password."}, status=400)
        token, _ = Token.objects.get_or_create(user=user)
        return Response({"token": token.key})


class MeView(APIView):
    @extend_schema(
        responses=inline_serializer("Me", {"id": serializers.IntegerField(), "username": serializers.CharField()})
    )
    def get(self, request: Request) -> Response:
        return Response({"id": request.user.pk, "username": request.user.get_username()})
