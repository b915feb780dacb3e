// Copyright 2020-2023 The NATS Authors
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
// http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

//! A Core NATS message.
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::header::HeaderMap;
use crate::status::StatusCode;
use crate::subject::Subject;

/// A Core NATS message.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Message {
    /// Subject to which message is published to.
    pub subject: Subject,
    /// Optional reply subject to which response can be published by [crate::Subscriber].
    /// Used for request-response pattern with [crate::Client::request].
    pub reply: Option<Subject>,
    /// Payload of the message. Can be any arbitrary data format.
    pub payload: Bytes,
    /// Optional headers.
    pub headers: Option<HeaderMap>,
    /// Optional Status of the message. Used mostly for internal handling.
    pub status: Option<StatusCode>,
    /// Optional [status][crate::Message::status] description.
    pub description: Option<String>,

    pub length: usize,
    /// What the client could not decode in the frame (Switchboard's patch, see
    /// `vendor/async-nats/PATCH.md`): the message is delivered anyway, never a dropped connection.
    #[serde(skip)]
    pub undecodable: Option<Undecodable>,
}

/// A part of an inbound frame the client could not decode (Switchboard's patch). Upstream drops
/// the whole connection for it, losing the frames that follow; here the message is delivered
/// with the part's raw bytes and the reason, and the rest of the connection is unaffected.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Undecodable {
    /// Why the part could not be decoded.
    pub reason: String,
    /// The header block as received (`NATS/1.0\r\n…`), when it was the part refused;
    /// `headers`, `status` and `description` are then `None`.
    pub raw_headers: Option<Bytes>,
    /// The subject as received, when it is not UTF-8; `subject` is then its lossy decoding.
    pub raw_subject: Option<Bytes>,
}

/// An outbound message to be published.
/// Does not contain status or description which are valid only for inbound messages.
#[derive(Clone, Debug)]
pub struct OutboundMessage {
    pub subject: Subject,
    pub reply: Option<Subject>,
    pub payload: Bytes,
    pub headers: Option<HeaderMap>,
}
