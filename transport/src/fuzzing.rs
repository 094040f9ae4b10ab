//! The body of the `session_frame_quic` fuzz target (see `flotilla_proto::fuzzing` for how the
//! targets are run and replayed).
//!
//! Not for: anything but fuzzing and its replay; nothing in flotilla calls it.

use bytes::BytesMut;
use flotilla_proto::fuzzing::FuzzInput;
use flotilla_proto::wire::{AgentFrame, HubFrame};
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

use crate::codec::FrameCodec;
use crate::link::LinkError;
use crate::quic::QuicSettings;

/// Bytes of the codec's length prefix.
const PREFIX: usize = 4;

/// `session_frame_quic`: a QUIC control stream's bytes, cut into reads at points the input
/// chooses, through the length-prefixed [`FrameCodec`] as the carrier reads it (frames until
/// the stream ends; bytes left over at the end are an error).
///
/// Properties: the frames and the error do not depend on where the stream is cut (whole, in
/// the input's pieces, or a byte at a time); every frame decoded encodes back to the same
/// frame and the codec reads its own output back; a length over the bound is refused from
/// the prefix alone, and the buffer never grows towards a refused length.
pub fn quic_frames(data: &[u8]) {
    let mut input = FuzzInput::new(data);
    // The carrier's own bound, and small ones that short inputs can exceed.
    let max = match input.byte() % 4 {
        0 => QuicSettings::default().max_frame_bytes,
        n => 16 << (3 * n),
    };
    let hub_side = input.byte().is_multiple_of(2);
    let cuts: Vec<usize> = (0..input.byte() % 8)
        .map(|_| usize::from(input.u16()))
        .collect();
    let stream = input.rest();
    if hub_side {
        stream_of::<AgentFrame>(stream, &cuts, max);
    } else {
        stream_of::<HubFrame>(stream, &cuts, max);
    }
}

/// What a reader got from one stream: its frames and how the stream ended.
type Read<T> = (Vec<T>, Result<(), LinkError>);

fn stream_of<T>(stream: &[u8], cuts: &[usize], max: usize)
where
    T: Message + Default + PartialEq + Clone + std::fmt::Debug,
{
    let whole = read::<T>(&[stream], max);
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
    points.sort_unstable();
    let mut pieces = Vec::new();
    let mut from = 0;
    for point in points {
        pieces.push(&stream[from..point]);
        from = point;
    }
    pieces.push(&stream[from..]);
    assert_eq!(
        read::<T>(&pieces, max),
        whole,
        "the frames depend on where the stream was cut"
    );
    let bytes: Vec<&[u8]> = stream.chunks(1).collect();
    assert_eq!(
        read::<T>(&bytes, max),
        whole,
        "the frames depend on where the stream was cut"
    );

    let (frames, _) = whole;
    let mut codec = FrameCodec::<T>::new(max);
    let mut written = BytesMut::new();
    for frame in &frames {
        assert_eq!(
            T::decode(frame.encode_to_vec().as_slice()).as_ref(),
            Ok(frame),
            "decode(encode(frame)) == frame"
        );
        codec
            .encode(frame.clone(), &mut written)
            .expect("a frame read within the bound is written within it");
    }
    assert_eq!(
        read::<T>(&[&written], max),
        (frames, Ok(())),
        "the codec reads back what it wrote"
    );
}

fn read<T>(pieces: &[&[u8]], max: usize) -> Read<T>
where
    T: Message + Default + std::fmt::Debug,
{
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let mut codec = FrameCodec::<T>::new(max);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for piece in pieces {
        buf.extend_from_slice(piece);
        loop {
            let decoded = codec.decode(&mut buf);
            // Room is made for at most one frame within the bound beyond what arrived (and
            // growth by doubling), never for a length the prefix claims beyond it.
            assert!(
                buf.capacity() <= 2 * (PREFIX + max + total),
                "{} bytes of buffer for a {total}-byte stream",
                buf.capacity()
            );
            match decoded {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(e) => {
                    if let LinkError::TooLarge { size, max: bound } = e {
                        assert!(size > bound && bound == max);
                    }
                    return (frames, Err(e));
                }
            }
        }
    }
    match codec.decode_eof(&mut buf) {
        Ok(Some(frame)) => panic!("a frame at the end that decode did not give: {frame:?}"),
        Ok(None) => (frames, Ok(())),
        Err(e) => (frames, Err(e)),
    }
}
