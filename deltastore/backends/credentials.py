"""Missing credentials: recognised in a client's errors and reported with where the client looked and how
to provide them (:class:`~deltastore.errors.CredentialsError`), instead of botocore's bare "Unable to
locate credentials"."""

from __future__ import annotations

from ..errors import CredentialsError
from .retry import _chain

#: client exceptions (matched by class name: no client library is imported here) that mean no credentials
#: were found or the named ones do not exist
_MISSING = {"NoCredentialsError", "PartialCredentialsError", "ProfileNotFound", "DefaultCredentialsError",
            "LocalTokenNotFoundError"}

_S3 = ("looked in the storage options (key/secret, token, profile), the environment (AWS_ACCESS_KEY_ID and "
       "AWS_SECRET_ACCESS_KEY, AWS_PROFILE), ~/.aws/credentials and ~/.aws/config, and the instance metadata "
       "service; provide them with -o key=ACCESS_KEY -o secret=SECRET_KEY (Python: storage_options={'key': ..., "
       "'secret': ...}), those environment variables, or -o profile=NAME; for a public bucket -o anon=true")
_GCS = ("looked in the storage option token and Google's application default credentials "
        "(GOOGLE_APPLICATION_CREDENTIALS, gcloud's saved login, the metadata server); provide them with "
        "-o token=/path/to/key.json (Python: storage_options={'token': ...}), GOOGLE_APPLICATION_CREDENTIALS, or "
        "`gcloud auth application-default login`; for a public bucket -o token=anon")
_HF = ("looked in the storage option token, HF_TOKEN and the saved login; provide one with -o token=hf_... "
       "(Python: storage_options={'token': ...}), HF_TOKEN=hf_..., or `hf auth login`")
HINTS = {"s3": _S3, "s3a": _S3, "gs": _GCS, "gcs": _GCS, "hf": _HF}


def missing_credentials(exc: BaseException) -> bool:
    """Whether ``exc`` (anywhere in its cause chain) says that no credentials were found."""
    return any(type(e).__name__ in _MISSING for e in _chain(exc))


def credentials_error(scheme: str, uri: str, cause: BaseException | None = None) -> CredentialsError:
    """The :class:`CredentialsError` for store ``uri`` of ``scheme``: the client's reason (when ``cause``
    is given), where it looked and how to provide credentials."""
    reason = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    hint = HINTS.get(scheme, "provide them in the storage options")
    return CredentialsError(f"no credentials for {uri}{reason}: {hint}")
