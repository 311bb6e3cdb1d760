"""The one receiver of folders that hosts ship: a run's logs from a host whose run folder the
control plane cannot read (`training.agent.log_shipper`) and a deployment's supervisor folder
(`serving.shipper`), both over `hostworker.shipper`'s append protocol: each POST is one piece
of one file at an offset, or a probe that asks whether the sender's folder is ours already.

A subclass says whose piece it is (`sender`: the run or deployment the bearer token is for,
else None and a 401), whether to take it (`accept`: raise to refuse, or answer that the folder
is shared) and where it goes (`append`); the body's checks, the base64 chunk and its size limit
are the same for both.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.exceptions import InvalidInput


class ShippedPieceView(APIView):
    permission_classes = [AllowAny]
    authentication_classes: list[Any] = []  # the sender's bearer token, checked by `sender`; no session/CSRF
    body: type[serializers.Serializer]  # the piece's fields (file, offset, chunk, probe, who sends it: a host's address and node, or its name)
    max_piece_bytes: int
    token_required: str  # the 401's detail: which token is required

    def sender(self, request: Request, **url: Any) -> Any | None:
        """Whose folder this is, if the request's bearer token says so; else None."""
        raise NotImplementedError

    def accept(self, owner: Any, piece: dict[str, Any]) -> bool:
        """Raise to refuse the piece; True if the sender's folder is the control plane's already
        (its probe is there), so that nothing needs shipping."""
        raise NotImplementedError

    def append(self, owner: Any, piece: dict[str, Any], data: bytes) -> int:
        """Write `data` at the piece's offset; return the file's size now, which the sender goes on from."""
        raise NotImplementedError

    def post(self, request: Request, **url: Any) -> Response:
        owner = self.sender(request, **url)
        if owner is None:
            return Response({"detail": self.token_required}, status=status.HTTP_401_UNAUTHORIZED)
        body = self.body(data=request.data)
        body.is_valid(raise_exception=True)
        piece = body.validated_data
        if self.accept(owner, piece):
            return Response({"shared": True})
        try:
            data = base64.b64decode(piece["chunk"], validate=True)
        except binascii.Error:
            raise InvalidInput("chunk", "must be base64") from None
        if len(data) > self.max_piece_bytes:
            raise InvalidInput("chunk", f"must be at most {self.max_piece_bytes} bytes; got {len(data)}")
        return Response({"offset": self.append(owner, piece, data)})
