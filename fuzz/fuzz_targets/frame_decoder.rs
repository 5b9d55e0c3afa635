//! Arbitrary bytes, cut into arbitrary chunks, into the frame decoder with
//! an arbitrary `max_frame`; and into the region list and NOTIFY payload
//! decoders. Nothing may panic; every frame given back has the payload its
//! header announced and stays within the bounds; the decoder buffers no
//! more than one frame; decoded lists and notifications encode back to
//! the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport_tcp::wire::{
    decode_notify, decode_regions, encode_notify, encode_regions, FrameDecoder, Header, HEADER_LEN, MAX_NOTIFY_PAYLOAD,
};

fuzz_target!(|data: &[u8]| {
    let Some((&[a, b, c], rest)) = data.split_first_chunk::<3>().map(|(h, r)| (h, r)) else {
        return;
    };
    // max_frame from 0 to 64 KiB; chunk sizes cycle through two values.
    let max_frame = usize::from(u16::from_le_bytes([a, b]));
    let cuts = [usize::from(c % 61) + 1, usize::from(c / 61) * 97 + 1];
    let bound = max_frame.max(MAX_NOTIFY_PAYLOAD).max(HEADER_LEN);
    let mut d = FrameDecoder::new(max_frame);
    let mut at = 0;
    let mut turn = 0;
    while at < rest.len() {
        let n = cuts[turn % 2].min(rest.len() - at);
        turn += 1;
        match d.push(&rest[at..at + n]) {
            Ok(frames) => {
                for (h, p) in frames {
                    assert_eq!(h.payload_len as usize, p.len(), "payload as announced");
                    assert!(p.len() <= bound, "payload within the frame bound");
                    // A decoded header encodes back to bytes that decode the same.
                    assert_eq!(Header::decode(&h.encode(), max_frame).ok(), Some(h));
                }
            }
            Err(_) => {
                assert!(d.push(b"").is_err(), "a failed decoder stays failed");
                break;
            }
        }
        assert!(d.buffered() <= bound + HEADER_LEN, "buffers at most one frame");
        at += n;
    }
    if let Ok(list) = decode_regions(rest) {
        assert_eq!(encode_regions(&list), rest, "region lists round-trip");
    }
    if let Ok((from, msg)) = decode_notify(rest) {
        assert_eq!(encode_notify(from, msg).as_deref(), Some(rest), "notifications round-trip");
    }
});
