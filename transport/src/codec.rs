//! Session frames on a byte stream (QUIC): each frame is a 4-byte big-endian length and the
//! protobuf message, with the same size bound as the gRPC carrier. A length over the bound is
//! refused before anything is buffered for it.

use std::marker::PhantomData;

use bytes::{Buf, BufMut, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::link::LinkError;

/// Bytes of the length prefix.
const PREFIX: usize = 4;

/// Encodes and decodes protobuf frames of type `T` with a length prefix, refusing any frame
/// over `max` bytes in either direction.
#[derive(Debug)]
pub struct FrameCodec<T> {
    max: usize,
    _frames: PhantomData<fn() -> T>,
}

impl<T> FrameCodec<T> {
    pub fn new(max: usize) -> FrameCodec<T> {
        FrameCodec {
            max,
            _frames: PhantomData,
        }
    }
}

impl<T> Clone for FrameCodec<T> {
    fn clone(&self) -> Self {
        FrameCodec::new(self.max)
    }
}

impl<T: prost::Message + Default> Decoder for FrameCodec<T> {
    type Item = T;
    type Error = LinkError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<T>, LinkError> {
        if src.len() < PREFIX {
            return Ok(None);
        }
        let size = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if size > self.max {
            return Err(LinkError::TooLarge {
                size,
                max: self.max,
            });
        }
        if src.len() < PREFIX + size {
            // Room for the rest of this frame, and no more.
            src.reserve(PREFIX + size - src.len());
            return Ok(None);
        }
        src.advance(PREFIX);
        let body = src.split_to(size);
        T::decode(body.freeze())
            .map(Some)
            .map_err(|e| LinkError::Malformed(e.to_string()))
    }
}

impl<T: prost::Message> Encoder<T> for FrameCodec<T> {
    type Error = LinkError;

    fn encode(&mut self, frame: T, dst: &mut BytesMut) -> Result<(), LinkError> {
        let size = frame.encoded_len();
        if size > self.max {
            return Err(LinkError::TooLarge {
                size,
                max: self.max,
            });
        }
        dst.reserve(PREFIX + size);
        dst.put_u32(size as u32);
        frame
            .encode(dst)
            .map_err(|e| LinkError::Malformed(e.to_string()))
    }
}

impl From<std::io::Error> for LinkError {
    fn from(e: std::io::Error) -> LinkError {
        LinkError::Transport(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use flotilla_proto::wire::{self, agent_frame};

    use super::*;

    fn heartbeat(seq: u64) -> wire::AgentFrame {
        wire::AgentFrame {
            frame: Some(agent_frame::Frame::Heartbeat(wire::Heartbeat { seq })),
        }
    }

    #[test]
    fn frames_round_trip_split_anywhere() {
        let mut codec = FrameCodec::<wire::AgentFrame>::new(1024);
        let mut wire_bytes = BytesMut::new();
        for seq in 1..=3 {
            codec.encode(heartbeat(seq), &mut wire_bytes).unwrap();
        }
        // Fed one byte at a time, as a stream may deliver it.
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in wire_bytes {
            buf.put_u8(b);
            while let Some(f) = codec.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, [heartbeat(1), heartbeat(2), heartbeat(3)]);
    }

    #[test]
    fn an_oversized_frame_is_refused_from_its_length_alone() {
        let mut codec = FrameCodec::<wire::AgentFrame>::new(16);
        let mut buf = BytesMut::new();
        buf.put_u32(1 << 30);
        assert_eq!(
            codec.decode(&mut buf),
            Err(LinkError::TooLarge {
                size: 1 << 30,
                max: 16
            })
        );
        let big = wire::AgentFrame {
            frame: Some(agent_frame::Frame::Goodbye(wire::Goodbye {
                reason: "x".repeat(64),
                refusal: 0,
            })),
        };
        assert!(matches!(
            codec.encode(big, &mut BytesMut::new()),
            Err(LinkError::TooLarge { max: 16, .. })
        ));
    }
}
